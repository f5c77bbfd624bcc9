"""What runs on each instance beside the trainer: the node agent (agent.py, started by the user
data, and the modules it is made of: docs/ARCHITECTURE.md, the agent), preflight (health.py,
gpu_health.py), torchrun as the node runs it (torchrun.py), the stand-in trainer (standin.py) and
the node's log (node_log.py). The trainer itself, the ranks under torchrun, is the package `trainer`.
"""
