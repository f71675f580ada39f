"""The reference TorchRec job of ettr: a DLRM on synthetic click data (see README.md)."""
