"""The one place that knows which major version of the ``sagemaker`` SDK is installed.

``sagemaker`` 2.x has ``Model`` and ``Predictor`` classes to build on; 3.x dropped them for
``ModelBuilder`` and the ``sagemaker-core`` resources (``sagemaker.core.resources``). The rest of
``sagemaker_sdk`` imports what it stands on from here: ``ModelBase`` and ``PredictorBase`` (what
``SagelmiModel`` and ``SagelmiPredictor`` subclass), the SDK's ``Session``, its ``LocalSession`` and
its stream ``ByteIterator``, from ``sagemaker_sdk.sdk_v2`` or ``sagemaker_sdk.sdk_v3``. Only the
module of the installed major is imported: no 2.x class is imported on 3.x.
"""

from __future__ import annotations

import importlib
from importlib import metadata

SUPPORTED = (2, 3)


def installed_major() -> int:
    """The major version of the installed ``sagemaker`` distribution.

    Raises ``ImportError`` saying what to install when it is missing or of a major not supported."""
    try:
        version = metadata.version("sagemaker")
    except metadata.PackageNotFoundError:
        raise ImportError("sagemaker_sdk needs the sagemaker SDK (2.x or 3.x): pip install 'sagelmi[sdk]'") from None
    major = int(version.split(".")[0])
    if major not in SUPPORTED:
        raise ImportError(
            f"sagemaker_sdk supports the sagemaker SDK 2.x and 3.x; sagemaker {version} is installed: "
            "pip install 'sagemaker>=2,<4'"
        )
    return major


MAJOR = installed_major()
_sdk = importlib.import_module(f"sagemaker_sdk.sdk_v{MAJOR}")

ModelBase = _sdk.ModelBase
PredictorBase = _sdk.PredictorBase
Session = _sdk.Session
LocalSession = _sdk.LocalSession
ByteIterator = _sdk.ByteIterator
