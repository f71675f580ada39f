"""`ettr.torch_compat`: every private torch API ettr calls answers on the installed torch. A torch release
that moves one fails here, in one place, rather than deep in a checkpoint or a compile."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from ettr import torch_compat  # noqa: E402


def test_dcp_s_private_parts_are_where_ettr_reaches_them():
    pytest.importorskip("fsspec")
    assert torch_compat.fsspec_writer_class().__name__ == "FsspecWriter"
    assert torch_compat.fsspec_reader_class().__name__ == "FsspecReader"
    assert hasattr(torch_compat.state_dict_stager_class(), "stage")
    nested = {"model": {"w": 0}}
    torch_compat.set_element(nested, ("model", "w"), 7)
    assert nested == {"model": {"w": 7}}


def test_inductor_s_caches_and_config(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    assert torch_compat.inductor_cache_dir() == str(tmp_path / "inductor")
    assert torch_compat.inductor_default_cache_dir()
    header_dir = torch_compat.inductor_header_dir()
    assert header_dir is None or isinstance(header_dir, str)
    assert torch_compat.inductor_used_precompiled_header() in (True, False)  # None: inductor changed
    assert callable(torch_compat.inductor_config().save_config_portable)


def test_dynamo_s_callbacks_counters_and_profile():
    handler = torch_compat.dynamo_callback_handler()
    assert callable(handler.register_start_callback) and callable(handler.remove_end_callback)
    assert torch_compat.dynamo_recompile_reason() is None  # not compiling now
    assert isinstance(torch_compat.dynamo_frames_compiled(), int)
    states, marker = torch_compat.pgo_profile()
    assert hasattr(states, "items") and marker is not None


def test_the_data_loader_s_iterator_base_and_the_default_group(tmp_path):
    import torch.distributed as dist

    assert callable(torch_compat.dataloader_iter_base().__next__)
    assert torch_compat.default_group() is None
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert torch_compat.default_group() is not None
        torch_compat.default_store().set("k", "v")
    finally:
        dist.destroy_process_group()
