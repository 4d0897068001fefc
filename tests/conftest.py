import pytest
import torch

# Tiny float64 models: one thread avoids oversubscription on small CI machines.
torch.set_num_threads(1)

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs a CUDA device"))]
