"""Online calibration of the model's rates against the live server, and the spread
of observed times around its predictions (p50 and p90)."""

from sidecar.calibration.calibrator import Calibrator
from sidecar.calibration.fit import RobustFit
from sidecar.calibration.health import Health, health, warning_kind
from sidecar.calibration.spread import Factors, Spread
from sidecar.calibration.store import (
    CalibrationFileError,
    CalibrationStore,
    SavedCalibration,
    read_calibration,
)

__all__ = ["CalibrationFileError", "CalibrationStore", "Calibrator", "Factors", "Health",
           "RobustFit", "SavedCalibration", "Spread", "health", "read_calibration",
           "warning_kind"]
