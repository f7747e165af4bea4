"""What the compiler did, as data (`to_dict`) and as a readable table (`str`)."""

from .report import Report

__all__ = ["Report"]
