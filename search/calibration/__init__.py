"""Calibration: ``aceso calibrate``'s fit (``calibrate.py``: each run priced by the one price, ``search.pricing``) and
the readers of the run logs it fits on (``megatron_log.py``, ``aceso_log.py``). The calibration file it writes and
how a file applies to a cluster sit below the price, with the cost model (``search.costmodel.calibration``).
"""
