"""The pure core: splitting, weighted averaging, step arithmetic, data order, modes.

Plain functions of tensors and numbers, tested without any process group. Nothing here imports
``torch.distributed`` or another layer of towers (``tests/test_architecture.py`` checks it).
"""
