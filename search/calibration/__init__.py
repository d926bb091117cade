"""Calibration: the calibration files and the helper that applies them (``calibration.py``), ``aceso calibrate``
(``calibrate.py``) and the readers of the run logs it fits on (``megatron_log.py``, ``aceso_log.py``).
"""
