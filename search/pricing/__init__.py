"""Pricing: the choice of cost model (``models.py``: ``make_cost_model``, ``KINDS``) and the one price of a plan
(``plan_price.py``: ``price``, ``plan_cost_model``, ``cost_model``, ``priced_cluster``), above the cost models
(``search.costmodel``, ``search.compat``) and the calibration file's reading and applying
(``search.costmodel.calibration``); ``aceso calibrate``'s fit (``search.calibration``) prices runs through it.
"""

from .models import KINDS, make_cost_model
from .plan_price import cost_model, plan_cost_model, price, priced_cluster

__all__ = ["KINDS", "cost_model", "make_cost_model", "plan_cost_model", "price", "priced_cluster"]
