"""A tensor-parallel handler for MPI mode: each rank holds a slice of every
layer, and the slices' partial results are summed across ranks (all-reduce).

Serve it on two ranks (two CPU processes here; two GPUs with NCCL where there are GPUs):

    OPTION_MPI_MODE=true TENSOR_PARALLEL_DEGREE=2 sagelmi serve --model-dir examples/tensor_parallel --port 8080
    curl -s localhost:8080/invocations -d '{"inputs": [[1, 2, 3, 4, 5, 6, 7, 8]]}'

Every rank receives every request in the same order and computes its share;
only rank 0's answer goes back. The handler is synchronous on purpose: calls
run one at a time, in arrival order, on every rank, so the all-reduces of one
request always meet each other. Weights and inputs are whole numbers in
float64, so the sharded sums equal the one-process result exactly.
"""

import os

import torch
import torch.distributed as dist

from djl_python import Input, Output

WIDTH = 8      # the model's hidden size
FFN = 32       # each layer's inner size, split across the ranks
LAYERS = 3
SEED = 0

model = None


class ShardedMLP:
    """``LAYERS`` residual MLP blocks; rank r holds columns r/world of the first
    matrix and the matching rows of the second (Megatron-style)."""

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        if FFN % world:
            raise ValueError(f"{FFN} inner units do not split over {world} ranks")
        self.world = world
        generator = torch.Generator().manual_seed(SEED)  # every rank draws the same full weights
        share = slice(rank * FFN // world, (rank + 1) * FFN // world)
        self.layers = []
        for _ in range(LAYERS):
            up = torch.randint(-2, 3, (WIDTH, FFN), generator=generator, dtype=torch.float64)
            down = torch.randint(-2, 3, (FFN, WIDTH), generator=generator, dtype=torch.float64)
            self.layers.append((up[:, share].to(device), down[share].to(device)))
        self.device = device

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.device, torch.float64)
        for up, down in self.layers:
            partial = torch.relu(x @ up) @ down  # this rank's share of the layer's output
            if self.world > 1:
                dist.all_reduce(partial)          # the shares summed: the whole layer's output
            x = x + partial
        return x


def _load(properties: dict) -> ShardedMLP:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if world > 1:  # MASTER_ADDR / MASTER_PORT come from sagelmi's MPI mode
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    return ShardedMLP(rank, world, device)


def handle(inputs: Input):
    global model
    if model is None:
        model = _load(inputs.get_properties())
    if inputs.is_empty():
        return None
    rows = inputs.get_as_json()["inputs"]
    result = model(torch.tensor(rows, dtype=torch.float64))
    return Output().add_as_json({"outputs": result.cpu().tolist(), "world_size": model.world})
