"""End-to-end TorchRec DLRM training under a sharding plan (see the README's roadmap)."""
