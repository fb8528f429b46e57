"""A model and a data module with a hyperparameter of one name and two meanings, as the example image classifier's
`channels` (its width) beside an image folder's (its colours): Lightning logs the two sets as one."""

from tasks.regression import Regressor, Table


class WideRegressor(Regressor):
    def __init__(self, in_features: int, channels: int = 32, lr: float = 1e-2) -> None:
        super().__init__(in_features, hidden=channels, lr=lr)
        self.save_hyperparameters()


class ColourTable(Table):
    def __init__(self, channels: int = 3, batch_size: int = 16) -> None:
        super().__init__(batch_size=batch_size)
        self.save_hyperparameters()
