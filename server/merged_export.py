"""`python -m server export --merged tinker://... --out DIR`: a checkpoint's adapter merged into its base model,
written as a Hugging Face model folder that transformers and vLLM load with no adapter.

Each adapted projection gets W + (alpha / r) B A, computed in float32 and stored in the base model's own
dtype; an adapted unembedding that shares its matrix with the embeddings is untied first, so that the
embeddings stay the base model's. The tokenizer, chat template and image processor files are copied
beside the weights. Routed-expert LoRA (MoE) is refused: it has no plain matrix to merge into. Works on
the server's database and checkpoint files, whether or not the server runs.
"""

import shutil
import sys

import torch
import transformers
from torch import nn

from server.config import ExportCommand, ModelConfig
from server.errors import InvalidRequest
from server.lora.checkpoint_io import load_checkpoint
from server.lora.layers import LoraAdapter
from server.models.builtin import TOKENIZER_FILES
from server.models.loading import resolve_model_dir
from server.models.registry import family_for
from server.store.checkpoints import parse_tinker_path
from server.store.db import has_server_database
from server.store.store import Store


def apply_merged_adapter(model: nn.Module, adapter: LoraAdapter) -> None:
    """Add the adapter's delta into the weights of the projections it adapts."""
    embeddings, unembedding = model.get_input_embeddings(), model.get_output_embeddings()
    for name in sorted(adapter.lora_A):
        module = model.get_submodule(name)
        if not isinstance(module, nn.Linear):
            raise InvalidRequest(f"{name} is a MoE's routed experts: a merged export of their LoRA is not supported")
        if module is unembedding and module.weight is embeddings.weight:
            module.weight = nn.Parameter(module.weight.detach().clone())
            for config in (model.config, model.config.get_text_config()):
                config.tie_word_embeddings = False
        delta = adapter.scale * (adapter.lora_B[name].float() @ adapter.lora_A[name].float())
        with torch.no_grad():
            module.weight.copy_((module.weight.float() + delta).to(module.weight.dtype))


def run_export_command(command: ExportCommand) -> int:
    if not has_server_database(command.database_url):
        print("no server database at --data-dir / --database-url", file=sys.stderr)
        return 2
    if command.out.exists() and any(command.out.iterdir()):
        print(f"--out {command.out} is not empty", file=sys.stderr)
        return 2
    store = Store(command.database_url)
    try:
        record = store.get_checkpoint(str(parse_tinker_path(command.merged)))
        run = store.get_training_run(record.model_id) if record is not None else None
    except InvalidRequest as error:
        print(error, file=sys.stderr)
        return 2
    finally:
        store.close()
    if record is None or record.checkpoint_type == "external":
        print(f"no checkpoint {command.merged} (weights/ or sampler_weights/ of a run on this server)", file=sys.stderr)
        return 2
    adapter = load_checkpoint(record.directory, "cpu", with_optimizer=False).adapter
    model_dir = resolve_model_dir(ModelConfig(base_model=run.base_model, model_path=command.model_path,
                                              model_cache_dir=command.model_cache_dir))
    family = family_for(transformers.AutoConfig.from_pretrained(model_dir).model_type)
    try:
        adapter.check_finite("the checkpoint's weights")  # one an older server saved before optim_step refused them
        model = getattr(transformers, family.auto_class).from_pretrained(model_dir, dtype="auto")
        apply_merged_adapter(model, adapter)
    except InvalidRequest as error:
        print(error, file=sys.stderr)
        return 2
    model.save_pretrained(command.out)
    for name in TOKENIZER_FILES:
        if (model_dir / name).exists() and not (command.out / name).exists():
            shutil.copyfile(model_dir / name, command.out / name)
    print(command.out)
    return 0
