"""One module per backend; importing this package registers every backend with the dispatcher.

``reference`` (pure PyTorch) is always there. The Triton backends (``triton`` for blocks of one
tile, ``triton_flash`` for longer blocks and full attention) register where triton imports;
``TRITON_IMPORT_ERROR`` holds the reason where it does not.
"""
from . import reference  # noqa: F401

try:
    import triton  # noqa: F401
except ImportError as _err:  # no triton on this platform: only the reference backend exists
    TRITON_IMPORT_ERROR = _err
else:
    TRITON_IMPORT_ERROR = None
    from . import triton_block  # noqa: F401
    from . import triton_flash  # noqa: F401
