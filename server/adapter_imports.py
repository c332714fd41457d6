"""Importing a PEFT LoRA adapter made elsewhere into a tenant: the REST route's work and
`python -m server adapters import PATH --tenant NAME`.

An import is a run of its own (in a session of its own, finished at once, as copy_weights makes one)
with two checkpoints of the same files: `weights/NAME`, which create_training_client_from_state loads
(no optimizer state: training starts with fresh moments), and `sampler_weights/NAME`, which
create_sampling_client and the OpenAI-compatible routes sample. The files are written in this server's
own PEFT layout (server/lora/checkpoint_io.py), after server/lora/peft_import.py checked them.
"""

import dataclasses
import json
import os
import shutil
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from server.config import AdaptersCommand
from server.errors import InvalidRequest
from server.lora.checkpoint_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS, save_peft_adapter
from server.lora.layers import LoraAdapter, apply_lora_wrappers
from server.lora.peft_import import read_peft_adapter
from server.models.builtin import served_name, spellings
from server.models.loading import resolve_model_dir
from server.models.registry import family_for
from server.store.checkpoints import TinkerPath, sync_directory_tree, validate_checkpoint_name
from server.store.db import has_server_database
from server.store.store import CheckpointRecord, Store, TrainingRunRecord, utcnow
from server.wire.models import LoraConfig


@dataclass(frozen=True)
class ImportedAdapter:
    training_run_id: str
    tinker_path: str
    """weights/NAME: for create_training_client_from_state."""
    sampler_path: str
    """sampler_weights/NAME: for create_sampling_client."""


def write_imported_adapter(store: Store, checkpoint_dir: Path, *, base_model: str, owner: str, name: str,
                           adapter: LoraAdapter, lora_config: LoraConfig) -> ImportedAdapter:
    """Journal a new run of `owner`'s holding the adapter as both kinds of checkpoint."""
    validate_checkpoint_name(name)
    session_id = str(uuid.uuid4())
    model_id = f"{session_id}:train:0"
    weights, sampler = TinkerPath(model_id, "weights", name), TinkerPath(model_id, "sampler_weights", name)
    weights_dir = weights.new_version_directory(checkpoint_dir)
    sampler_dir = sampler.new_version_directory(checkpoint_dir)
    size = save_peft_adapter(weights_dir, adapter, base_model, lora_config, num_steps=0)
    sampler_dir.mkdir(parents=True)
    for file in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):  # shared bytes; each checkpoint still deletes on its own
        try:
            os.link(weights_dir / file, sampler_dir / file)
        except OSError:
            shutil.copy2(weights_dir / file, sampler_dir / file)
    sync_directory_tree(weights_dir)
    sync_directory_tree(sampler_dir)
    store.create_session(session_id, tags=[], user_metadata={}, sdk_version=None, display_name=f"import of {name}",
                         owner=owner)
    store.finish_session(session_id, "imported")
    store.create_training_run(TrainingRunRecord(
        model_id=model_id, session_id=session_id, owner=owner, base_model=base_model, model_seq_id=0,
        lora_rank=lora_config.rank, seed=None, train_mlp=lora_config.train_mlp, train_attn=lora_config.train_attn,
        train_unembed=lora_config.train_unembed, user_metadata={"imported_from": "peft"}))
    now = utcnow()
    for path, directory, kind in ((weights, weights_dir, "training"), (sampler, sampler_dir, "sampler")):
        store.add_checkpoint(CheckpointRecord(
            tinker_path=str(path), model_id=model_id, checkpoint_id=path.checkpoint_id, checkpoint_type=kind,
            directory=str(directory), size_bytes=size, owner=owner, created_at=now))
    return ImportedAdapter(training_run_id=model_id, tinker_path=str(weights), sampler_path=str(sampler))


def run_adapters_command(command: AdaptersCommand) -> int:
    """`adapters import`: check the folder against the base model's LoRA targets (found from its config alone,
    without loading its weights), then write it as the tenant's; prints the paths as JSON."""
    if not has_server_database(command.database_url):
        print("no server database at --data-dir / --database-url (a server creates it on its first start)",
              file=sys.stderr)
        return 2
    try:
        peft_config = json.loads((command.path / ADAPTER_CONFIG).read_text())
        weights = (command.path / ADAPTER_WEIGHTS).read_bytes()
    except (OSError, ValueError) as error:
        print(f"{command.path} is not a PEFT adapter folder: {error}", file=sys.stderr)
        return 2
    model_dir = resolve_model_dir(command.model)
    hf_config = transformers.AutoConfig.from_pretrained(model_dir)
    family = family_for(hf_config.model_type)
    with torch.device("meta"):  # the modules' names and shapes, no weights
        network = getattr(transformers, family.auto_class).from_config(hf_config)
    targets, _ = apply_lora_wrappers(network, family)
    store = Store(command.database_url)
    try:
        adapter, lora_config = read_peft_adapter(peft_config, weights, targets,
                                                 spellings(command.model.base_model) | {str(model_dir)},
                                                 command.max_lora_rank)
        imported = write_imported_adapter(store, command.checkpoint_dir,
                                          base_model=served_name(command.model.base_model), owner=command.tenant,
                                          name=command.name, adapter=adapter, lora_config=lora_config)
    except InvalidRequest as error:
        print(error, file=sys.stderr)
        return 2
    finally:
        store.close()
    print(json.dumps(dataclasses.asdict(imported)))
    return 0
