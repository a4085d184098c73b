"""End-to-end TorchRec DLRM training under a sharding plan: model, data, runner, stages (see docs/e2e.md)."""
