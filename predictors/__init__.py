"""Next-iteration speed predictors for LB-BSP (DESIGN.md section 5).

``get_predictor("narx", hidden=10)`` builds one; every predictor takes a worker's speed and the
exogenous inputs of each iteration (:data:`EXOG_KEYS` order, see :func:`exog_from_telemetry`) and
forecasts the next speed. Importing this package registers the built-in predictors; statsmodels
and torch are imported lazily, by the predictors that need them.
"""

from predictors import arima, ema, last, narx  # noqa: F401  (registers the built-ins)
from predictors.base import (
    EXOG_KEYS,
    PREDICTOR_REGISTRY,
    Predictor,
    exog_from_telemetry,
    get_predictor,
    predictor_names,
    register_predictor,
)

__all__ = [
    "EXOG_KEYS",
    "PREDICTOR_REGISTRY",
    "Predictor",
    "exog_from_telemetry",
    "get_predictor",
    "predictor_names",
    "register_predictor",
]
