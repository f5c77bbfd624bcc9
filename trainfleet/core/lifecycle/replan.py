"""Re-plan pp x dp for the nodes at hand, within what the trainer can run (tp stays as asked)."""

from trainfleet.core import memory_plan
from trainfleet.core.records import ParallelPlan
from trainfleet.core.runspec import RunSpec, TrainerConfig, layout_problem


def initial_plan(spec: RunSpec, allocated_nodes: int) -> ParallelPlan | None:
    """The first layout: the RunSpec's own when all its nodes came, else the best on what came
    (never below min_nodes; None when nothing runs on them)."""
    par = spec.trainer.parallel
    if allocated_nodes >= spec.node_count:
        return ParallelPlan(nodes=spec.node_count, ranks_per_node=spec.facts.ranks_per_node, pp=par.pp, dp=par.dp,
                            tp=par.tp)
    return plan_layout(spec.trainer, spec.facts.ranks_per_node, allocated_nodes, spec.shrink_floor, par.pp,
                       memory_gib=spec.facts.memory_per_rank_gib, accelerator=spec.facts.accelerator)


def plan_layout(config: TrainerConfig, ranks_per_node: int, available_nodes: int, min_nodes: int,
                preferred_pp: int, memory_gib: float = 0, accelerator: str = "H100") -> ParallelPlan | None:
    """The best layout on at most `available_nodes` and at least `min_nodes` nodes, or None.

    Most nodes first (idle nodes are paid for nothing). Among layouts on as many nodes, the
    pp nearest to `preferred_pp` from above: a larger pp keeps fewer layers per rank, so a model
    that fitted in memory still fits, while a smaller pp could run out of it.
    The global batch, the microbatch count and tp stay as configured, so the run trains on the
    same batches (the trainer's checkpoints reshard to any layout).
    With `memory_gib` (GPU memory per rank; 0 on CPU types) on an `accelerator` (the catalogue's
    name: NCCL's buffers depend on it) a layout must also fit it: fewer
    data-parallel ranks hold larger FSDP shards. This needs the whole model in `config`, which
    the run record has (Validate records the trainer section with its defaults filled in).
    """
    tp = config.parallel.tp
    for nodes in range(available_nodes, min_nodes - 1, -1):
        groups = nodes * ranks_per_node // tp
        runnable = [pp for pp in _divisors(groups) if layout_problem(config, pp, groups // pp) is None
                    and _fits(config, pp, groups // pp, memory_gib, accelerator)]
        if runnable:
            pp = min(runnable, key=lambda pp: (pp < preferred_pp, abs(pp - preferred_pp)))
            return ParallelPlan(nodes=nodes, ranks_per_node=ranks_per_node, pp=pp, dp=groups // pp, tp=tp)
    return None


def _fits(config: TrainerConfig, pp: int, dp: int, memory_gib: float, accelerator: str) -> bool:
    if not memory_gib:
        return True
    sections = config.as_trainer_mapping(pp, dp, {})
    return memory_plan.fits(memory_plan.Workload.from_sections(sections, accelerator=accelerator), memory_gib)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
