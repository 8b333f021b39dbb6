"""A handler with a dependency the image does not have: the server installs requirements.txt
(next to this file) with pip before it imports the handler.

Try it in the image: docs/image.md, "Test the image locally".
"""

from slugify import slugify

from djl_python import Input, Output


def handle(inputs: Input):
    if inputs.is_empty():  # the initialisation call
        return None
    return Output().add_as_json({"slug": slugify(inputs.get_as_json()["inputs"])})
