"""A model named the way users name it (memkit/naming.py): presets, their hub ids offline, folders, config.json files,
hub ids through huggingface_hub (patched: no test uses the network), and the list of diffusers classes."""

import json
import re
from pathlib import Path

import pytest
import torch

import memkit
from memkit import naming
from memkit.cli import main
from memkit.presets import PRESETS

README = Path(__file__).resolve().parents[1] / "README.md"


def write_config(folder: Path, config: dict, class_name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps({"_class_name": class_name, "_diffusers_version": "0.42.1", **config}))
    return path


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No network and an empty hub cache, whatever the machine has."""
    monkeypatch.setattr(naming, "_hub_reachable", lambda: False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_answers_to_its_name_and_its_hub_id_offline(name, offline):
    hub_id = PRESETS[name].hub_id
    assert re.fullmatch(r"[\w.-]+/[\w.-]+", hub_id), hub_id
    for spelled in (name, hub_id, hub_id.lower(), hub_id.upper() + "/"):
        ref = naming.resolve(spelled)
        assert (ref.preset, ref.class_name, ref.source) == (name, PRESETS[name].model_class, spelled)


def test_a_config_json_a_folder_and_a_pipeline_folder_resolve_to_the_class_and_its_config(tmp_path):
    config = dict(PRESETS["sana"].configs["tiny"])
    file = write_config(tmp_path / "pipe" / "transformer", config, "SanaTransformer2DModel")
    for spelled in (file, str(file), tmp_path / "pipe" / "transformer", tmp_path / "pipe"):
        ref = naming.resolve(spelled)
        assert ref.preset is None and ref.class_name == "SanaTransformer2DModel"
        assert json.loads(json.dumps(dict(ref.config))) == json.loads(json.dumps(config))  # no _class_name, no _version


def test_a_config_is_estimated_as_its_class_preset_built_from_it(tmp_path):
    # the preset's tiny config as a config.json: the same model; a config takes the preset's full-size inputs
    file = write_config(tmp_path, dict(PRESETS["sana"].configs["tiny"]), "SanaTransformer2DModel")
    from_file = memkit.estimate(file, progress=False)
    full_inputs = PRESETS["sana"].input_sizes["full"]
    assert full_inputs["height"] == 1024  # SanaPipeline's default, not the tiny preset's 64 px
    from_preset = memkit.estimate("sana", size="tiny", progress=False, **full_inputs)
    assert from_file.peak_bytes == from_preset.peak_bytes and from_file.meta["parameters"] == 55_904
    assert from_file.meta["steady_peak_bytes"] == from_preset.meta["steady_peak_bytes"]
    with pytest.raises(ValueError, match="size='tiny' applies to presets"):
        memkit.estimate(file, size="tiny", progress=False)


def test_an_estimate_of_a_changed_config_file_is_not_the_cached_one(tmp_path):
    config = dict(PRESETS["sana"].configs["tiny"])
    file = write_config(tmp_path, config, "SanaTransformer2DModel")
    before = memkit.estimate(file, progress=False)
    write_config(tmp_path, config | {"num_layers": 3}, "SanaTransformer2DModel")
    after = memkit.estimate(file, progress=False)
    assert after.meta["parameters"] > before.meta["parameters"]


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_a_class_without_a_preset_is_refused_for_its_inputs_and_estimated_with_given_ones(tmp_path):
    config = dict(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(8, 16), norm_num_groups=4,
                  down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
                  layers_per_block=1)  # fmt: skip
    file = write_config(tmp_path, config, "UNet2DModel")
    with pytest.raises(ValueError, match=r"UNet2DModel, whose inputs memkit cannot build .* pass inputs="):
        memkit.estimate(file, progress=False)

    def inputs(model):
        return {"sample": torch.randn(1, 4, 8, 8, dtype=torch.bfloat16), "timestep": torch.tensor([10])}

    tl = memkit.estimate(file, inputs=inputs, progress=False)
    params = tl.meta["parameters"]
    assert params > 0 and tl.peak_bytes > params * 2 * 4  # bf16 weights, gradients and AdamW's two moments


@pytest.mark.extended  # CI time (16 s): HiDream is no preset; its refusal is test_estimate's value-sized forward
def test_hidream_is_refused_for_its_expert_routing_whatever_its_inputs(tmp_path, capsys):
    # its mixture of experts sizes each expert's tokens by the router's choices (tests/test_estimate.py runs both modes)
    config = dict(patch_size=2, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
                  num_attention_heads=2, caption_channels=[16, 16], text_emb_dim=16, axes_dims_rope=[4, 2, 2],
                  llama_layers=[0, 1])  # fmt: skip
    file = write_config(tmp_path, config, "HiDreamImageTransformer2DModel")
    pattern = r"HiDreamImageTransformer2DModel, which memkit cannot estimate: .*aten\.nonzero.*memkit\.compare"
    with pytest.raises(NotImplementedError, match=pattern):
        memkit.estimate(file, inputs=lambda model: {}, progress=False)
    (row,) = [c for c in naming.diffusers_classes() if c.class_name == "HiDreamImageTransformer2DModel"]
    assert (
        not row.supported
        and row.refused == "its MoE routing sizes tensors by value"
        and row.why.startswith("refused: HiDream-I1's mixture-of-experts")
    )
    cell = "refused: its MoE routing sizes tensors by value (measure with `compare`)"
    assert f"| `HiDreamImageTransformer2DModel` | image | {cell} |" in naming.support_table()
    assert naming.unestimable("FluxTransformer2DModel") is None
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"^\s+HiDreamImageTransformer2DModel\s+image\s+refused: its MoE routing sizes tensors by value$", out, re.M
    )


def test_bad_names_get_clear_errors(tmp_path, offline):
    with pytest.raises(ValueError, match=r"unknown model 'fluxx'.*did you mean flux, flux2-dev\?"):
        naming.resolve("fluxx")
    with pytest.raises(ValueError, match="holds no config.json"):
        naming.resolve(tmp_path)
    with pytest.raises(ValueError, match="needs the network once .* close to it: black-forest-labs/FLUX.1-dev"):
        naming.resolve("black-forest-labs/FLUX.1-dv")  # a hub id, offline, no cache: and a preset's id close to it
    bad = write_config(tmp_path / "new", {"num_layers": 2}, "FluxNineTransformer2DModel")
    with pytest.raises(ValueError, match=r"FluxNineTransformer2DModel, which diffusers .* does not have .* 0\.42\.1"):
        naming.resolve(bad)
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a readable JSON config"):
        naming.resolve(tmp_path / "broken.json")
    with pytest.raises(TypeError, match="model must be"):
        naming.resolve("")


def test_a_hub_id_downloads_only_its_config_json(tmp_path, monkeypatch):
    import huggingface_hub

    file = write_config(tmp_path / "transformer", dict(PRESETS["sana"].configs["tiny"]), "SanaTransformer2DModel")
    asked = []

    def download(repo_id, filename, subfolder=None, local_files_only=False):
        asked.append((repo_id, filename, subfolder))
        if subfolder != "transformer":
            raise huggingface_hub.errors.RemoteEntryNotFoundError("no such file", response=None)
        return str(file)

    monkeypatch.setattr(naming, "_hub_reachable", lambda: True)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    ref = naming.resolve("someone/sana-finetune")
    assert asked == [("someone/sana-finetune", "config.json", "transformer")]  # one file, never the weights
    assert ref.class_name == "SanaTransformer2DModel" and ref.preset is None


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_cli_estimates_a_hub_id_and_a_config_and_refuses_an_unknown_name(tmp_path, capsys, offline):
    assert main(["estimate", "Efficient-Large-Model/Sana_1600M_1024px_diffusers", "--size", "tiny", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["preset"] == "sana" and out["class"] == "SanaTransformer2DModel" and out["parameters"] == 55_904
    file = write_config(tmp_path, dict(PRESETS["sana"].configs["tiny"]), "SanaTransformer2DModel")
    assert main(["estimate", str(file), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["preset"] is None and out["model"] == str(file) and out["peak_bytes"] > 0
    assert main(["estimate", str(file), "--size", "tiny"]) == 2
    assert "--size tiny applies to presets" in capsys.readouterr().err
    assert main(["estimate", "no-such/model"]) == 2
    err = capsys.readouterr().err
    assert "memkit estimate: error: no-such/model is not a preset's hub id" in err and "Traceback" not in err


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_memkit_models_lists_every_preset_and_every_diffusers_class(capsys):
    import diffusers

    assert main(["models"]) == 0
    text = capsys.readouterr().out
    for p in PRESETS.values():
        assert re.search(rf"^\s+{re.escape(p.name)}\s+{re.escape(p.hub_id)}\s+{p.model_class}\s", text, re.M), p.name
    names = [
        n for n in dir(diffusers) if n.endswith(("Transformer2DModel", "Transformer3DModel")) or n.startswith("UNet")
    ]
    assert len(names) > 50 and all(re.search(rf"^\s+{n}\s", text, re.M) for n in names)
    assert re.search(r"^\s+SanaTransformer2DModel\s+image\s+preset sana$", text, re.M)
    assert re.search(r"^\s+AllegroTransformer3DModel\s+video\s+refused: no input builder$", text, re.M)
    assert text.index("\nimage:\n") < text.index("  flux ") < text.index("\nvideo:\n") < text.index("  wan ")
    assert main(["models", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    counts = {p["name"]: p["parameters"] for p in out["presets"]}
    assert counts["flux"] == 11_901_408_320 and counts["sana"] == 1_604_462_752  # FLUX.1-dev 11.9B, Sana 1.6B
    supported = {c["cls"] for c in out["classes"] if c["supported"]}
    assert supported == {p.model_class for p in PRESETS.values()}


def test_the_readme_support_table_is_the_generated_one():
    # regenerate: python -c "from memkit.naming import support_table; print(support_table())"
    assert naming.support_table() in README.read_text()


def test_the_readme_presets_table_names_every_preset_with_its_class_and_hub_id():
    text = README.read_text()
    for p in PRESETS.values():
        assert f"| `{p.name}` | `{p.model_class}` | `{p.hub_id}` |" in text, p.name
