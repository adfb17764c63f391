"""Imports every backend module so that each registers itself with the dispatcher."""
from . import _reference_op  # noqa: F401

try:
    import triton  # noqa: F401
except ImportError as _err:  # no triton on this platform: only the reference backend exists
    TRITON_IMPORT_ERROR = _err
else:
    TRITON_IMPORT_ERROR = None
    from . import _triton_op  # noqa: F401
    from . import _triton_flash_op  # noqa: F401
