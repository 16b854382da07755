"""Kernel choices kept between processes (`kernel_choices.py`): a later process on the same machine starts from the
choices an earlier one measured, other machines and torch builds do not, and a file that cannot be read or written
only costs a measurement."""

import json

import pytest
import torch

from transformers_dflash import kernel_choices, kernels


@pytest.fixture
def new_process(monkeypatch, tmp_path):
    """A function that puts the kernels module in the state of a new process (no choices in memory, the file not read
    yet), with the choice files under `tmp_path`; the measurement is a stand-in that records its calls and "finds" the
    transposed product fastest."""
    monkeypatch.setenv("DFLASH_KERNEL_CACHE", str(tmp_path / "kernels"))
    measured = []
    monkeypatch.setattr(
        kernels, "_measure", lambda flat, weight, cold=None: measured.append(flat.shape[0]) or "transposed"
    )

    def start():
        monkeypatch.setattr(kernels, "_kernel_choice", {})
        monkeypatch.setattr(kernels, "_choices_file", kernels._UNREAD)
        measured.clear()
        return measured

    return start


def test_a_later_process_starts_from_the_choices_an_earlier_one_measured(new_process, tmp_path):
    weight = torch.randn(40, 24)
    measured = new_process()
    assert [kernels.kernel_for(weight, rows) for rows in (2, 3, 2)] == ["transposed"] * 3
    assert measured == [2, 3]  # once per row count
    files = list((tmp_path / "kernels").glob("*.json"))
    assert len(files) == 1
    document = json.loads(files[0].read_text())
    assert document["machine"]["torch"] == torch.__version__
    threads = torch.get_num_threads()
    assert document["choices"] == [[40, 24, 2, threads, "transposed"], [40, 24, 3, threads, "transposed"]]

    measured = new_process()
    assert kernels.kernel_for(weight, 2) == "transposed" and measured == []  # read, not measured again
    assert kernels.kernel_for(weight, 4) == "transposed" and measured == [4]  # a new row count is measured ...
    new_process()
    assert {tuple(c[:3]) for c in json.loads(files[0].read_text())["choices"]} == {
        (40, 24, 2),
        (40, 24, 3),
        (40, 24, 4),
    }

    # ... and what the file says is used as it is: the choice of an earlier process stands.
    document["choices"][0][4] = "linear"
    files[0].write_text(json.dumps(document))
    measured = new_process()
    assert kernels.kernel_for(weight, 2) == "linear" and measured == []


def test_another_machine_or_torch_build_measures_for_itself(new_process, monkeypatch, tmp_path):
    weight = torch.randn(40, 24)
    measured = new_process()
    kernels.kernel_for(weight, 2)
    assert measured == [2]
    monkeypatch.setattr(kernel_choices.torch, "__version__", "0.0.0-another-build")
    measured = new_process()
    kernels.kernel_for(weight, 2)
    assert measured == [2]  # a file of its own
    assert len(list((tmp_path / "kernels").glob("*.json"))) == 2
    monkeypatch.setattr(kernel_choices, "FORMAT", kernel_choices.FORMAT + 1)  # a changed measurement: not reused
    measured = new_process()
    kernels.kernel_for(weight, 2)
    assert measured == [2]


@pytest.mark.parametrize(
    "content",
    ["{not json", "[]", json.dumps({"choices": [[40, 24, 2, 1, "fastest"], [40, "24", 2, 1, "linear"], "x", 7]})],
    ids=["corrupt", "not-a-dict", "invalid-entries"],
)
def test_a_file_that_cannot_be_used_costs_only_a_measurement(new_process, content):
    weight = torch.randn(40, 24)
    path = kernel_choices.choices_file(kernel_choices.describe_machine(kernels.packing_available()))
    path.parent.mkdir(parents=True)
    path.write_text(content)
    measured = new_process()
    assert kernels.kernel_for(weight, 2) == "transposed" and measured == [2]
    assert json.loads(path.read_text())["choices"] == [[40, 24, 2, torch.get_num_threads(), "transposed"]]


def test_a_folder_that_refuses_the_file_or_off_keeps_the_choices_in_memory(new_process, monkeypatch, tmp_path):
    weight = torch.randn(40, 24)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("DFLASH_KERNEL_CACHE", str(blocked / "kernels"))  # its parent is a file: no folder there
    measured = new_process()
    assert kernels.kernel_for(weight, 2) == "transposed" and kernels.kernel_for(weight, 2) == "transposed"
    assert measured == [2]  # measured once, kept in memory
    for off in ("off", "0", ""):
        monkeypatch.setenv("DFLASH_KERNEL_CACHE", off)
        assert kernel_choices.choices_folder() is None
        measured = new_process()
        kernels.kernel_for(weight, 2)
        assert measured == [2] and kernels._choices_file is None
    assert not list(tmp_path.rglob("*.json")) and not list(tmp_path.rglob("*.tmp"))


def test_the_default_folder_is_under_the_package_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("DFLASH_KERNEL_CACHE")
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    assert kernel_choices.choices_folder() == tmp_path / "kernels"
    monkeypatch.delenv("DFLASH_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert kernel_choices.choices_folder() == tmp_path / ".cache" / "transformers_dflash" / "kernels"


def test_choices_written_by_two_processes_are_merged(tmp_path):
    path = tmp_path / "choices.json"
    machine = kernel_choices.describe_machine(False)
    kernel_choices.save_choices(path, machine, {(8, 4, 2, 1): "packed"})
    kernel_choices.save_choices(path, machine, {(8, 4, 3, 1): "linear"})
    assert kernel_choices.load_choices(path) == {(8, 4, 2, 1): "packed", (8, 4, 3, 1): "linear"}
