"""An inference-toolkit script of sagelmi's own (not a public example) for MPI mode: every rank loads
and runs it; each records what it saw in the directory named by SAGELMI_TEST_RECORD_DIR
(<rank>.log: the model_fn call, then one line per request), and the answer names the rank."""

import json
import os

RANK = int(os.environ.get("RANK", "0"))


def _record(line):
    with open(os.path.join(os.environ["SAGELMI_TEST_RECORD_DIR"], f"{RANK}.log"), "a") as f:
        f.write(line + "\n")


def model_fn(model_dir, context):
    _record(f"model_fn world_size={os.environ.get('WORLD_SIZE')}")
    return lambda values: [2 * v for v in values]


def predict_fn(data, model):
    _record(f"predict {json.dumps(data)}")
    return {"doubled": model(data["values"]), "rank": RANK}
