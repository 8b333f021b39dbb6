"""Deploying the sagelmi image with the ``sagemaker`` SDK, 2.x or 3.x (the ``sdk`` extra;
``sagemaker_sdk.sdk_major`` picks what to stand on): ``SagelmiModel`` (settings as typed
arguments, checked with the container's own schema before any AWS call; ``deploy()`` to an
endpoint, or as an inference component with ``InferenceComponentConfig``),
``SagelmiPredictor`` (LMI and OpenAI schemas, streaming), and
``sagemaker_sdk.local.LocalEndpoint`` (the same settings on this machine, in a container or
a plain process).

Runs on the user's machine: imports neither vLLM, torch nor gunicorn.
"""

from container.core.engine_args import EngineOptionError
from container.core.settings import SettingsError
from sagemaker_sdk.component import InferenceComponentConfig
from sagemaker_sdk.model import DoesNotFit, SagelmiModel
from sagemaker_sdk.predictor import SagelmiPredictor
from sagemaker_sdk.sdk_major import MAJOR as SDK_MAJOR
from sagemaker_sdk.streaming import StreamError, StreamParser, parse_stream

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
