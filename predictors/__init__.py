"""Next-iteration speed predictors for LB-BSP (DESIGN.md section 5).

``get_predictor("narx", hidden=10)`` builds one; every predictor takes a worker's speed and the
exogenous inputs of each iteration (``ps_common.report.EXOG_KEYS`` order, see
``Telemetry.exog``) and forecasts the next speed. Importing this package registers the built-in predictors; statsmodels
and torch are imported lazily, by the predictors that need them.
"""

from predictors import arima, ema, last, narx  # noqa: F401  (registers the built-ins)
from predictors.base import (
    PREDICTOR_REGISTRY,
    Predictor,
    get_predictor,
    predictor_names,
    register_predictor,
)

__all__ = [
    "PREDICTOR_REGISTRY",
    "Predictor",
    "get_predictor",
    "predictor_names",
    "register_predictor",
]
