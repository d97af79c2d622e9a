"""The Double-DQN router (arXiv 2408.13510 §5.3): featurizer, network and policy.

``features`` and ``network`` are shared by the trainer (``routerd.rl``) and the
runtime policy, so what the agent learned on the simulator is what it sees live.
Inference runs in numpy; torch is needed only to train.
"""
