"""Inductor's on-disk cache lands where the next run finds it, unless the user chose a directory."""

from megatron_lowprec.optim.compile_cache import keep_inductor_cache


def test_the_inductor_cache_goes_under_xdg_cache_home_or_home_unless_chosen(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert keep_inductor_cache() == str(tmp_path / "xdg" / "megatron_lowprec" / "inductor")

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert keep_inductor_cache() == str(tmp_path / "home" / ".cache" / "megatron_lowprec" / "inductor")

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "chosen"))
    assert keep_inductor_cache() == str(tmp_path / "chosen")
