"""Training data that resumes exactly where a preempted run stopped, in the middle of an epoch too.

A data module returns an ordinary `DataLoader(dataset, batch_size=..., shuffle=True)`. Every run
rebuilds that training loader, as Lightning itself rebuilds loaders to add a DistributedSampler,
into a `ResumableDataLoader` over the same dataset with the same arguments (`ResumableData`, a
callback the command line adds). Its order comes from the seed and the epoch alone, and each
process reads its own share of it. No loader draws from torch's global random number generator,
which the model's randomness (dropout) uses and checkpoints restore.

Lightning keeps the state of a training loader that has `state_dict`/`load_state_dict` in its
checkpoints and hands it back when it resumes from one that ended mid-epoch. The state here is
where the job stands: the epoch, how many samples of its order the job has trained on (from the
batches the Trainer counts: a loader may have handed out more, as Lightning fetches ahead when it
cannot tell from the loader's length which batch is the last), and on how many processes. A job
restarted on another number of processes goes on with the rest of the epoch, shared out over the
processes it has now. Its loader workers seed each batch's random draws (augmentation) from the batch's place
in the epoch's order, so they too draw the same in a resumed run as in one never stopped.

A `RandomSampler` of a set number of draws (or with replacement), a `WeightedRandomSampler` and a
`SubsetRandomSampler` (a split by indices) are rebuilt the same way: their draws and orders, too, come from the
seed and the epoch (samplers.py); a `BatchSampler` spelled out, as `batch_size` and `drop_last`.
A `DistributedSampler` of the data module's own (code written for plain PyTorch's DDP) keeps its seed, order and
shares, and resumes as the kit's own sampler does.
A batch sampler of the data module's own is kept, and read through `OwnBatches` (own_batches.py), which also goes
on with the epoch on another number of processes.
Several training loaders that Lightning combines are each rebuilt so, each keeping its place in its own pass
(Lightning starts a shorter one's pass again within the epoch); on another number of processes the epoch goes on
with the rest of the loader that sets its length, and each other loader with the rest of its pass. Loaders over
an IterableDataset (litdata's streaming loader among them) keep their own state, and loaders with another sampler
of their own are left as they are.
"""

import functools
import os
from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
from lightning.fabric.utilities.data import _reinstantiate_wrapped_cls, sized_len
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.utilities import CombinedLoader, rank_zero_warn
from lightning.pytorch.utilities.data import (
    _dataloader_init_kwargs_resolve_sampler,
    _get_dataloader_init_args_and_kwargs,
)
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from trainkit.data.own_batches import OwnBatches
from trainkit.data.samplers import (
    DistributedResumableSampler,
    RandomResumableSampler,
    ResumableSampler,
    SubsetResumableSampler,
    WeightedResumableSampler,
)
from trainkit.data.worker_seeds import seeded_batches


def batches_trained(trainer: Trainer) -> int | None:
    """How many batches of the current epoch training has finished; None once it has finished them all."""
    trained = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    return None if trained >= trainer.num_training_batches else trained


def count_batches_from(trainer: Trainer, batches: int) -> None:
    """Make the Trainer count the batches of the epoch it resumes on from `batches`, not from the checkpoint's count.

    Lightning ends an epoch once its count of the epoch's batches on each process reaches the epoch's
    length in batches. On another number of processes than the checkpoint's, each process has another
    number of batches left than that count says.
    """
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    batches = min(batches, trainer.num_training_batches)  # past `limit_train_batches`: the epoch is over
    shift = batches - progress.processed  # the counts of a batch under way move with it
    progress.ready, progress.started = progress.ready + shift, progress.started + shift
    progress.processed, progress.completed = progress.processed + shift, progress.completed + shift


class ResumableDataLoader(DataLoader):
    """A training DataLoader over a map-style dataset that Lightning resumes mid-epoch.

    Its random draws (the seeds of its worker processes) come from a generator seeded by the
    epoch, not from torch's global generator, which checkpoints restore for the model's use. Its
    workers seed each batch from its place in the epoch's order (`seeded_batches`). A batch sampler of
    its own is read through `OwnBatches`.
    """

    def __init__(
        self,
        *args: Any,
        trainer: Trainer | None = None,
        combined: str | None = None,
        seed: int = 0,
        remake_batches: Callable[[Sampler], Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.trainer = trainer
        # One of several loaders Lightning combines in this mode ("max_size_cycle" or "min_size"), each giving a
        # batch at every step: a shorter one starts a new pass of the same order when it runs out, so its place is
        # in its current pass.
        self.combined = combined
        self.went_on = (0, 0, 0, 0)  # the epoch, the Trainer's count, the samples and passes this run went on at
        if self.generator is None:
            self.generator = torch.Generator()
        self.own_batches: OwnBatches | None = None
        if has_own_batches(self):
            rank, processes = (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
            self.own_batches = OwnBatches(self.batch_sampler, seed, rank, processes, remake=remake_batches)
        draws_order = self.own_batches is not None or isinstance(self.sampler, ResumableSampler)
        if self.num_workers > 0 and draws_order:  # each batch's first index carries the seed its worker draws from
            if self.own_batches is not None:
                self.own_batches.seeded = True
            else:
                self.sampler.seeded_batch_size = self.batch_size
            self.worker_init_fn = functools.partial(seeded_batches, self.worker_init_fn)

    @property
    def _index_sampler(self) -> Any:
        # Where torch's DataLoader takes its batches of indices from. The batch sampler itself is left in
        # `batch_sampler`, where Lightning gives it the sampler of each process's share.
        own_batches = getattr(self, "own_batches", None)  # None while DataLoader.__init__ runs
        return own_batches if own_batches is not None else super()._index_sampler

    def __iter__(self) -> Iterator[Any]:
        # A generator, so nothing is drawn before the first batch is asked for: Lightning creates
        # the iterator before it sets the epoch, and workers would start on the order at once.
        if self.own_batches is not None and self.trainer is not None:
            self.own_batches.set_epoch(self.trainer.current_epoch)
        drawn_by = self.drawn_by()
        self.generator.manual_seed(getattr(drawn_by, "seed", 0) + getattr(drawn_by, "epoch", 0))
        yield from super().__iter__()
        if self.combined and isinstance(self.sampler, ResumableSampler):
            self.sampler.resumed = (0, 0)  # the pass a checkpoint ended in is over: the next one starts at the start
            self.sampler.passes = (self.sampler.epoch, self.sampler.passes_finished() + 1)

    def state_dict(self) -> dict[str, int]:
        # The job's place in the epoch, not this process's: the next run may have more or fewer processes.
        processes, trained = self.processes(), batches_trained(self.trainer)
        epoch = getattr(self.drawn_by(), "epoch", 0)
        if trained is None:  # after an epoch's last batch, the next run starts the next epoch
            return {"epoch": epoch + 1, "samples": 0, "processes": processes}
        if self.own_batches is not None:  # each process's batches, and the arrangements the epoch went on from
            own, earlier = self.own_batches, self.own_batches.earlier()
            state = {"epoch": epoch, "own_batches": trained - own.first_batch(), "processes": processes}
            return {**state, "went_on": [list(arrangement) for arrangement in earlier]} if earlier else state
        if self.combined:  # a batch at each of the epoch's steps, a new pass after every len(self)
            return {"epoch": epoch, **self.place_in_pass(epoch, trained), "processes": processes}
        # Every process has trained on as many batches, all whole ones, since this run went on with the epoch.
        samples = (trained - self.first_batch()) * self.batch_size * processes
        if isinstance(self.sampler, ResumableSampler):
            samples += self.sampler.trained_before()
        return {"epoch": epoch, "samples": samples, "processes": processes}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if self.own_batches is not None:
            self.load_own_batches(state)
            return
        # `trainer.overfit_batches` swaps in a plain sequential sampler: nothing to resume then.
        if not isinstance(self.sampler, ResumableSampler):
            return
        # Checkpoints from before the job's place was kept count one process's batches: written on as many as now.
        samples = state.get("samples", state.get("batches", 0) * self.batch_size * self.processes())
        passes = state.get("passes", 0)  # of a combined loader's order, finished in the epoch
        before, now = state.get("processes", self.processes()), self.processes()
        self.sampler.set_epoch(state["epoch"])
        self.sampler.resumed = (state["epoch"], samples)
        self.sampler.passes = (state["epoch"], passes)
        if self.combined:
            counted = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed if self.trainer else 0
            self.went_on = (state["epoch"], counted, samples, passes)
            if before != now and self is combined_with(self)[-1]:  # the last of them to get its state
                go_on_resharded(combined_with(self), before)
            return
        if samples:  # mid-epoch
            count_batches_from(self.trainer, self.first_batch())
            if before != now:
                self.sampler.say_resharded(before)

    def load_own_batches(self, state: dict[str, Any]) -> None:
        own, epoch = self.own_batches, state["epoch"]
        batches, before, now = state.get("own_batches", 0), state.get("processes", self.processes()), self.processes()
        earlier = tuple((processes, trained) for processes, trained in state.get("went_on", []))
        resharded = before != now and bool(batches or earlier)
        if resharded and not own.reshardable():  # each process's batches come from its share, another one now
            name = type(self.batch_sampler).__name__
            warn_not_resumable(f"loader's batch sampler ({name}) made batches on {before} processes and is on {now}")
            batches, earlier, resharded = 0, (), False
        elif resharded:  # the rest of the batches each process had, shared out anew
            batches, earlier = 0, (*earlier, (before, batches))
        own.epoch, own.resumed, own.went_on = epoch, (epoch, batches), (epoch, earlier)
        if resharded:
            count_batches_from(self.trainer, own.first_batch())
            own.say_resharded(before)

    def place_in_pass(self, epoch: int, trained: int) -> dict[str, int]:
        """A combined loader's place once the Trainer counted `trained` batches of the epoch: in which pass of its
        order, and how many samples into it (it went on with a pass where this run began, then started new ones)."""
        _, count, samples, passes = self.went_on if self.went_on[0] == epoch else (epoch, 0, 0, 0)
        batches = trained - count  # since this run went on with the epoch
        first_pass = len(self)  # the sequential sampler of `overfit_batches` resumes nothing
        if isinstance(self.sampler, ResumableSampler):
            first_pass = self.sampler.batches_left(self.batch_size, self.drop_last, trained=samples)
        if batches < first_pass:
            return {"samples": samples + batches * self.batch_size * self.processes(), "passes": passes}
        batches -= first_pass
        return {"samples": batches % len(self) * self.batch_size * self.processes(),
                "passes": passes + 1 + batches // len(self)}  # fmt: skip

    def drawn_by(self) -> Any:
        """What draws the epoch's order and keeps its epoch: the batch sampler's batches, or the sampler."""
        return self.sampler if self.own_batches is None else self.own_batches

    def first_batch(self) -> int:
        """Where the Trainer's count of the epoch's batches stood when this run began on the epoch (or went on)."""
        if not isinstance(self.sampler, ResumableSampler):
            return 0
        return len(self) - self.sampler.batches_left(self.batch_size, self.drop_last)

    def processes(self) -> int:
        if self.own_batches is not None:
            return self.own_batches.processes
        return getattr(self.sampler, "num_replicas", 1)


def shuffles(sampler: Sampler, dataset: Sized) -> bool | None:
    """Whether an ordinary DataLoader's sampler shuffles (`shuffle=True`) or not; None for a sampler of its own."""
    if type(sampler) is SequentialSampler:
        return False
    if type(sampler) is RandomSampler and not sampler.replacement and sampler.num_samples == len(dataset):
        return True
    return None


def has_own_batches(loader: DataLoader) -> bool:
    """Whether `loader` is batched by a batch sampler of its own: not by `batch_size` (nor a BatchSampler spelled
    out, which batches as `batch_size` does)."""
    return loader.batch_size is None and type(loader.batch_sampler) not in (BatchSampler, type(None))


def not_resumable_because(loader: Any) -> str | None:
    """Why `loader` is not one that `resumable` rebuilds; None for one that it rebuilds."""
    if not isinstance(loader, DataLoader):
        return f"is a {type(loader).__name__}, not a DataLoader"
    if type(loader) is not DataLoader:
        return f"is a DataLoader subclass ({type(loader).__name__})"
    if isinstance(loader.dataset, IterableDataset):
        return "reads an IterableDataset and keeps no state"
    batches = loader.batch_sampler
    if batches is None:
        return "reads its samples one by one (batch_size=None)"
    if has_own_batches(loader):
        no_length = not isinstance(batches, Sized)  # its epoch has no known end, nor place to resume at
        return f"uses a batch sampler of its own ({type(batches).__name__}) with no length" if no_length else None
    drawn_by = batches.sampler  # a BatchSampler's: made by the DataLoader from `batch_size`, or spelled out
    rebuilt_too = (RandomSampler, WeightedRandomSampler, SubsetRandomSampler, DistributedSampler)
    if shuffles(drawn_by, loader.dataset) is None and type(drawn_by) not in rebuilt_too:
        return f"uses a sampler of its own ({type(drawn_by).__name__})"
    return None


def warn_not_resumable(reason: str) -> None:
    rank_zero_warn(f"exact resume: the training {reason}, so a resume mid-epoch starts the epoch over"
                   ' (docs/data.md, "Which training loaders resume mid-epoch")')  # fmt: skip


def resumable_training(loaders: Any, trainer: Trainer) -> Any:
    """The training loaders, each rebuilt by `resumable` where there is one.

    Lightning combines several loaders (a dict or a list of them, or a CombinedLoader of the data module's) into
    one batch of each at every step. In its modes for training that give every loader's next batch at every step
    ("max_size_cycle", its default, which starts a shorter loader's pass again when it runs out, and "min_size"),
    each loader's place follows from the Trainer's count of the epoch's batches.
    """
    combined = loaders if isinstance(loaders, CombinedLoader) else CombinedLoader(loaders, "max_size_cycle")
    if len(combined.flattened) == 1 and combined is not loaders:  # one loader: the data module's own
        return apply_to_collection(loaders, DataLoader, lambda loader: resumable(with_own_generator(loader), trainer))
    leaves = [with_own_generator(leaf) if isinstance(leaf, DataLoader) else leaf for leaf in combined.flattened]
    if combined._mode not in ("max_size_cycle", "min_size"):
        warn_not_resumable(f'loaders are combined in mode "{combined._mode}", where a loader that ran out gives None')
        combined.flattened = leaves
    else:
        combined.flattened = [resumable(leaf, trainer, combined=combined._mode) for leaf in leaves]
    return loaders if combined is loaders else combined.iterables


def combined_with(loader: ResumableDataLoader) -> list[Any]:
    """The training loaders that Lightning combines with `loader` (and `loader` itself), in Lightning's order."""
    return CombinedLoader(loader.trainer.train_dataloader).flattened


def go_on_resharded(loaders: list[Any], before: int) -> None:
    """Combined loaders that got their places of a job on `before` processes go on with the epoch on those now.

    Each goes on with the rest of its pass, shared out over the processes now. The epoch's length on the processes
    now is the longest loader's ("max_size_cycle", the others cycled) or the shortest's ("min_size"): the Trainer
    counts its batches from where the rest of that loader's pass leaves it.
    """
    if not all(isinstance(getattr(loader, "sampler", None), ResumableSampler) for loader in loaders):
        return  # one keeps no place of its own (and said so): the Trainer counts the epoch's batches as before
    if not any(loader.sampler.trained_before() or loader.sampler.passes_finished() for loader in loaders):
        return  # at the epoch's start
    longest = loaders[0].combined == "max_size_cycle"
    length = (max if longest else min)(len(loader) for loader in loaders)
    sets_length = [loader for loader in loaders if len(loader) == length]
    left = {loader: loader.sampler.batches_left(loader.batch_size, loader.drop_last) for loader in sets_length}
    last = (max if longest else min)(sets_length, key=left.get)
    count_batches_from(last.trainer, length - left[last])
    last.sampler.say_resharded(before)
    processed = last.trainer.fit_loop.epoch_loop.batch_progress.current.processed
    for loader in loaders:
        epoch, _, samples, passes = loader.went_on
        loader.went_on = (epoch, processed, samples, passes)


def resumable(loader: Any, trainer: Trainer, combined: str | None = None) -> Any:
    """`loader` rebuilt as a ResumableDataLoader with every argument it was given, when it is a plain DataLoader over
    a map-style dataset (an IterableDataset's loader has no order to resume).

    One that batches with `batch_size` (or a BatchSampler spelled out) in a sequential, shuffled, randomly drawn,
    weighted, subset's shuffled or distributed order gets a ResumableSampler; one with a batch sampler of its own
    keeps it (`with_own_batches`).
    `combined`: it is one of several that Lightning combines, in this mode (`resumable_training`).
    """
    if hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict"):
        if sized_len(loader) is None:
            rank_zero_warn(
                "exact resume: the training loader keeps its own state but has no length: Lightning fetches a batch"
                " ahead of the one it trains on (to tell which is the last), so a checkpoint keeps the loader's state"
                " one batch on, and a resume mid-epoch skips a batch. Give the dataset `__len__`"
                ' (docs/data.md, "Which training loaders resume mid-epoch")'
            )
        return loader  # it resumes itself, and Lightning saves its state (torchdata's, litdata's)
    reason = not_resumable_because(loader)
    if reason is None and combined and has_own_batches(loader):
        reason = "uses a batch sampler of its own and is one of several that Lightning combines"
    if reason is not None:
        warn_not_resumable(f"loader {reason}")
        return loader
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))  # seed_everything's, as for Lightning's own sampler
    if has_own_batches(loader):
        return with_own_batches(loader, trainer, seed)
    # Each process its own share, as Lightning's DistributedSampler would give it; with
    # `use_distributed_sampler: false` the data module shares out the data itself.
    shares = sharing(trainer)
    num_replicas, rank = (shares["num_replicas"], shares["rank"]) if shares else (1, 0)
    batches = loader.batch_sampler
    drawn = batches.sampler  # a BatchSampler's: made by the DataLoader from `batch_size`, or spelled out
    shuffle = shuffles(drawn, loader.dataset)
    if type(drawn) is DistributedSampler:  # the data module shares out its data itself
        sampler = DistributedResumableSampler(drawn)
    elif type(drawn) is WeightedRandomSampler:
        sampler = WeightedResumableSampler(
            loader.dataset, drawn.weights, drawn.num_samples, drawn.replacement, num_replicas, rank, seed=seed
        )
    elif type(drawn) is SubsetRandomSampler:
        sampler = SubsetResumableSampler(loader.dataset, drawn.indices, num_replicas, rank, seed=seed)
    elif shuffle is None:  # a RandomSampler of a set number of draws, or with replacement
        sampler = RandomResumableSampler(loader.dataset, drawn.num_samples, drawn.replacement, num_replicas, rank, seed)
    else:
        sampler = ResumableSampler(loader.dataset, num_replicas, rank, seed=seed, shuffle=shuffle)
    # Lightning's own way of re-creating a loader with another sampler, which keeps its other arguments.
    args, kwargs = _get_dataloader_init_args_and_kwargs(loader, sampler)
    if loader.batch_size is None:  # a BatchSampler spelled out: as the same `batch_size` and `drop_last`
        kwargs.update(batch_size=batches.batch_size, drop_last=batches.drop_last)
    return _reinstantiate_wrapped_cls(
        loader, *args, explicit_cls=ResumableDataLoader, trainer=trainer, combined=combined, **kwargs
    )


def with_own_batches(loader: DataLoader, trainer: Trainer, seed: int) -> DataLoader:
    """`loader` made again as a ResumableDataLoader, with the arguments it was made with (its batch sampler among
    them, which it reads through OwnBatches). Lightning shares a batch sampler's `sampler` out over the processes
    afterwards, as it does without the kit."""
    if not hasattr(loader, "__pl_saved_args"):  # Lightning records a loader's arguments in `train_dataloader`
        name = type(loader.batch_sampler).__name__
        warn_not_resumable(f"loader, batched by a batch sampler of its own ({name}), was made outside"
                           " `train_dataloader`, where Lightning records its arguments")  # fmt: skip
        return loader
    args, kwargs = loader.__pl_saved_args, loader.__pl_saved_kwargs
    remake: Callable[[Sampler], Any] | None = functools.partial(batch_sampler_over, loader)
    shuffle = shuffles(getattr(loader.batch_sampler, "sampler", None), loader.dataset)
    if shuffle is not None and trainer._accelerator_connector.use_distributed_sampler and not sharing(trainer):
        # One process batches the one share of the epoch's order, as each of several batches its own (Lightning's
        # DistributedSampler): the batches of any number of processes can then be drawn again to go on from.
        one_share = DistributedSampler(loader.dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=seed)
        try:
            args, kwargs = _get_dataloader_init_args_and_kwargs(loader, one_share)
        except TypeError:  # it takes no `sampler` to be made again with
            remake = None
    return _reinstantiate_wrapped_cls(
        loader, *args, explicit_cls=ResumableDataLoader, trainer=trainer, seed=seed, remake_batches=remake, **kwargs
    )


def batch_sampler_over(loader: DataLoader, sampler: Sampler) -> Any:
    """The batch sampler of `loader` made again over `sampler`, as Lightning makes it over each process's share."""
    return _dataloader_init_kwargs_resolve_sampler(loader, sampler)["batch_sampler"]


def sharing(trainer: Trainer) -> dict[str, int] | None:
    """How Lightning shares the training data out over the processes (`num_replicas`, `rank`); None where it does
    not: on one process, or with `use_distributed_sampler: false` (the data module shares it out itself)."""
    if not trainer._accelerator_connector.use_distributed_sampler:
        return None
    return trainer.distributed_sampler_kwargs or None


def with_own_generator(loader: DataLoader) -> DataLoader:
    """`loader`, drawing the seeds of its worker processes from a generator of its own.

    Otherwise each new iterator draws them from torch's global generator, which checkpoints
    restore for the model's use. A loader with `persistent_workers` makes its one iterator in
    the sanity check (which puts the draw back) in a fresh run, but later in a resumed one.
    """
    if loader.generator is None:
        loader.generator = torch.Generator()
    return loader


class ResumableData(Callback):
    """Make the loaders of a data module (or model) resume exactly, with no code of its own.

    Lightning asks the data module for its loaders when a fit starts (and again with
    `reload_dataloaders_every_n_epochs`). During a fit, that request returns the training
    loaders rebuilt by `resumable_training` and the validation loaders `with_own_generator`, before
    Lightning measures them or restores their state from a checkpoint.
    """

    def __init__(self) -> None:
        self.source: LightningDataModule | LightningModule | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # Where Lightning asks for the loaders: the data module when there is one.
        self.source = trainer.datamodule if trainer.datamodule is not None else pl_module
        self._replace("train_dataloader", lambda loaders: resumable_training(loaders, trainer))
        self._replace("val_dataloader", lambda loaders: apply_to_collection(loaders, DataLoader, with_own_generator))

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A model that reads `trainer.estimated_stepping_batches` in configure_optimizers (for a learning-rate
        # schedule) makes Lightning load the training loaders before it reads the checkpoint, and then never
        # hand them their state: it is handed over here, before the first batch is drawn (once; no-op otherwise).
        trainer.fit_loop._load_combined_loader_states()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.source is not None:
            del self.source.train_dataloader, self.source.val_dataloader  # the data module's own methods again
            self.source = None

    def _replace(self, hook: str, change: Callable[[Any], Any]) -> None:
        requested: Callable[[], Any] = getattr(self.source, hook)

        # `wraps` lets Lightning still tell whether the data module defines the hook itself.
        @functools.wraps(requested)
        def changed() -> Any:
            return change(requested())

        setattr(self.source, hook, changed)
