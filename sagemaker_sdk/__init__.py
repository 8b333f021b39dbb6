"""Deploying the sagelmi image with the ``sagemaker`` SDK (v2, the ``sdk`` extra):
``SagelmiModel`` (settings as typed arguments, checked with the container's own
schema before any AWS call), ``SagelmiPredictor`` (LMI and OpenAI schemas,
streaming), and ``sagemaker_sdk.local.LocalEndpoint`` (the same settings on this
machine, in a container or a plain process).

Runs on the user's machine: imports neither vLLM, torch nor gunicorn.
"""

from container.core.engine_args import EngineOptionError
from container.core.settings import SettingsError
from sagemaker_sdk.model import DoesNotFit, SagelmiModel
from sagemaker_sdk.predictor import SagelmiPredictor
from sagemaker_sdk.streaming import StreamError, StreamParser, parse_stream

__all__ = [
    "SagelmiModel",
    "DoesNotFit",
    "SagelmiPredictor",
    "SettingsError",
    "EngineOptionError",
    "StreamError",
    "StreamParser",
    "parse_stream",
]
