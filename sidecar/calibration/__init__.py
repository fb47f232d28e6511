"""Online calibration of the model's efficiency terms against the live server."""

from sidecar.calibration.calibrator import CalibrationStatus, Calibrator
from sidecar.calibration.fit import RobustLine
from sidecar.calibration.store import CalibrationStore

__all__ = ["CalibrationStatus", "CalibrationStore", "Calibrator", "RobustLine"]
