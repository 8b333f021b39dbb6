"""The core: what every other part of sagelmi shares and that imports none of them.

Settings (``settings``, ``serving_properties``), the engine-argument schema (``engine_args``),
errors (``errors``), the wire protocol and launch records (``protocol``, ``launch``), device and
deployment planning (``devices``, ``plan``, ``instances``, ``sizing``), model files
(``artifacts``), and process and logging hygiene (``proc``, ``logs``). The SDK uses only this.
"""
