"""Deploying the sagelmi image with the ``sagemaker`` SDK, 2.x or 3.x (the ``sdk`` extra;
``sagemaker_sdk.sdk_major`` picks what to stand on): ``SagelmiModel`` (settings as typed
arguments, checked with the container's own schema before any AWS call; ``deploy()`` to an
endpoint, or as an inference component with ``InferenceComponentConfig``),
``SagelmiPredictor`` (LMI and OpenAI schemas, streaming), and
``sagemaker_sdk.local.LocalEndpoint`` (the same settings on this machine, in a container or
a plain process).

Runs on the user's machine: imports neither vLLM, torch nor gunicorn.
"""

import logging
import os

# The sagemaker SDK's chatter when it is imported, quieted before it is (below) with the
# SDK's own switches, so that a user sees sagelmi's lines: its config loader's INFO lines on stdout
# ("Not applying SDK defaults from location ..."; the SDK leaves a level a user set alone, and so does
# this), and SDK 2.x's notices that 2.x is being retired, which name sagelmi's own classes
# ("SagelmiModel is part of the SageMaker Python SDK v2") and which the variable the notice names
# turns off (a value the user set is kept).
if logging.getLogger("sagemaker.config").level == logging.NOTSET:
    logging.getLogger("sagemaker.config").setLevel(logging.WARNING)
os.environ.setdefault("SAGEMAKER_SUPPRESS_V2_WARNING", "1")

from container.core.engine_args import EngineOptionError  # noqa: E402
from container.core.settings import SettingsError  # noqa: E402
from sagemaker_sdk.component import InferenceComponentConfig  # noqa: E402
from sagemaker_sdk.model import DoesNotFit, SagelmiModel  # noqa: E402
from sagemaker_sdk.predictor import SagelmiPredictor  # noqa: E402
from sagemaker_sdk.sdk_major import MAJOR as SDK_MAJOR  # noqa: E402
from sagemaker_sdk.streaming import StreamError, StreamParser, parse_stream  # noqa: E402

__all__ = [
    "SagelmiModel",
    "DoesNotFit",
    "InferenceComponentConfig",
    "SagelmiPredictor",
    "SDK_MAJOR",
    "SettingsError",
    "EngineOptionError",
    "StreamError",
    "StreamParser",
    "parse_stream",
]
