"""gpucast training package: the estimators' training, export, manifest and golden fixture.

    python -m gpucast_training mlp|timm|simulated|golden|evaluate|all    (from training/)

Importing the package (and `features`, `label_audit`) needs the standard library only.
"""
