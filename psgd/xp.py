"""Moved (psgd.moved): ``get_array_module`` is :mod:`psgd.model`'s; the old name warns, for a while."""

from psgd.moved import forward

__getattr__ = forward(__name__)
