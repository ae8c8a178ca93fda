"""The committed cubins must match the current CUDA sources (no nvcc needed)."""
import json

from mok_rt import build


def test_cubins_are_up_to_date():
    problems = build.check_manifest()
    assert not problems, "stale cubins:\n" + "\n".join(problems)


def test_manifest_records_build_facts():
    data = json.loads(build.MANIFEST.read_text())
    assert data["cubins"], "no cubins built"
    for e in data["cubins"]:
        assert e["target"] == "sm_90a"
        assert e["nvcc_version"]
        assert any("compute_90a" in f for f in e["flags"])
        assert e["source"] in e["sources"]
        assert len(e["sha256"]) == 64


def test_check_detects_a_changed_source(tmp_path, monkeypatch):
    data = json.loads(build.MANIFEST.read_text())
    e = data["cubins"][0]
    src = next(iter(e["sources"]))
    e["sources"][src] = "0" * 64
    fake = tmp_path / "manifest.json"
    fake.write_text(json.dumps(data))
    monkeypatch.setattr(build, "MANIFEST", fake)
    problems = build.check_manifest()
    assert any(src in p and "changed" in p for p in problems)
