"""Training ranks other than 0: one process per extra local GPU, started by the server itself.

Each loads the base model on its own device, shards it with the other ranks (FSDP2) or holds it whole
(--base-sharding, as rank 0's server was given), and then runs rank 0's collective calls until the server
stops, or ends when rank 0 dies (lifelines.py). On further
nodes, torchrun starts the same ranks: `TORCH_ELASTIC_WORKER_IDENTICAL=1 torchrun --nnodes N --node-rank K
--nproc-per-node G --master-addr HOST --master-port PORT -m server.training.workers --base-model ...
[the server's model flags]`, with the server on node 0 started with the same rendezvous (see the README;
the variable has torchrun number the ranks itself, as no torchrun runs on node 0 to do it).
"""

import logging
import multiprocessing

import torch.distributed as dist

from server.config import ServerConfig, parse_config, rank_from_environment
from server.heap import freeze_startup_objects
from server.training.lifelines import exit_when_leader_dies
from server.training.parallel import init_training_group
from server.training.trainer import build_trainer


def run_rank(config: ServerConfig, rank: int) -> None:
    """One follower rank: join the group, shard or replicate the model, follow rank 0 until it stops."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
    trainer_config = config.trainer
    group = init_training_group(rank, trainer_config.world_size, config.model.device_type,
                                trainer_config.master_addr, trainer_config.master_port,
                                trainer_config.training_devices, trainer_config.local_ranks)
    exit_when_leader_dies(group.lifelines)
    trainer = build_trainer(config.model, trainer_config, config.images.feature_cache_bytes, group)
    freeze_startup_objects()
    trainer.follow_leader()
    group.lifelines.stop()  # rank 0 said stop: its exit to come is no death
    dist.destroy_process_group()


def start_local_ranks(config: ServerConfig) -> list[multiprocessing.Process]:
    """Ranks 1..local_ranks-1 of this node as child processes (rank 0 is the server's own process)."""
    context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    ranks = [context.Process(target=run_rank, args=(config, rank), name=f"training-rank-{rank}", daemon=True)
             for rank in range(1, config.trainer.local_ranks)]
    for process in ranks:
        process.start()
    return ranks


if __name__ == "__main__":
    run_rank(parse_config(), rank_from_environment())
