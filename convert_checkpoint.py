"""Convert a checkpoint of any layout into a HuggingFace GPT-2 or Llama folder.

    python convert_checkpoint.py --load runs/ckpt --hf_output gpt2-export

The folder (``config.json`` and ``model.safetensors``) loads with
``transformers.GPT2LMHeadModel.from_pretrained`` and no code of ours (a fine-tuned checkpoint's
with ``GPT2ForQuestionAnswering`` or ``GPT2ForSequenceClassification``), or, for a model of the
Llama variants, with ``transformers.LlamaForCausalLM.from_pretrained``. The other direction is
``run_pretraining.py --hf_model FOLDER``.
"""

from __future__ import annotations

from pathlib import Path

from config.command_line import exit_on_bad_input
from config.errors import ConfigError
from config.loading import OneLineParser
from execution.checkpoint.load import read_weights
from modelling.hf_interchange import HFModelError, export_hf


def main(argv: list[str] | None = None) -> None:
    summary = __doc__.split("\n")[0]
    parser = OneLineParser(prog="convert_checkpoint.py", description=summary, allow_abbrev=False)
    parser.add_argument("--load", required=True, help="A --save folder or one step_N in it.")
    parser.add_argument("--hf_output", required=True, help="Folder to write the HF model into.")
    args = parser.parse_args(argv)
    model_config, weights = read_weights(args.load)
    out = Path(args.hf_output)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--hf_output {out} is a file; give a folder (new or empty)")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--hf_output {out} is not empty; choose a new folder")
    try:
        params = export_hf(model_config, weights, out)
    except OSError as err:
        raise ConfigError(f"cannot write --hf_output {out}: {err.strerror}") from None
    except HFModelError as err:
        raise ConfigError(str(err)) from None
    print(f"wrote {out}/config.json and {out}/model.safetensors ({params:,} parameters)")


if __name__ == "__main__":
    exit_on_bad_input(main, "convert_checkpoint.py")
