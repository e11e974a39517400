"""utils.plot draws a run's metrics.jsonl into a PNG (checked by decoding the image)."""

from __future__ import annotations

import json

import matplotlib.image
import pytest

from utils.plot import main, plot_run, series


def _write_metrics(folder, steps=20):
    rows = []
    for step in range(1, steps + 1):
        loss, lr, speed = 10.0 / step, 1e-3 * step, 1000.0 + step
        rows.append(
            {"step": step, "loss": loss, "lr": lr, "grad_norm": 1.0, "tokens_per_sec": speed}
        )
        if step % 5 == 0:
            rows.append({"step": step, "eval_loss": 11.0 / step})
    text = "\n".join(json.dumps(r) for r in rows) + '\n{"step": 21, "lo'  # a torn last line
    (folder / "metrics.jsonl").write_text(text)


def test_plot_writes_a_png_with_every_curve(tmp_path, capsys):
    _write_metrics(tmp_path)
    main([str(tmp_path)])
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'metrics.png'}"
    image = matplotlib.image.imread(tmp_path / "metrics.png")
    assert image.shape[0] > 300 and image.shape[1] > 500
    assert image.std() > 0.05  # not a blank canvas
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()[:-1]]
    assert series(rows, "eval_loss") == ([5, 10, 15, 20], [11 / 5, 11 / 10, 11 / 15, 11 / 20])


def test_a_folder_without_steps_is_an_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "eval_loss": 3.0}\n')
    with pytest.raises(ValueError, match="no training steps"):
        plot_run(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "missing")])
    assert exit_info.value.code == 2
