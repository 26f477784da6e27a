"""What several test files share, by area, as ``torch/testing/_internal/common_*.py`` serves
torch's tests: models, data, references and sharding helpers (a test file imports them from here,
never from another test file). The train-and-compare loop of the FSDP tests is
``tests/common_fsdp.py``."""
