"""Imports a package that only requirements.txt installs."""

import sagelmi_reqcheck

from djl_python import Input, Output


def handle(inputs: Input):
    if inputs.is_empty():
        return None
    return Output().add_as_json({"message": sagelmi_reqcheck.MESSAGE})
