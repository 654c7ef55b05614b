"""gpucast training package: the estimators' training, export and manifest.

    python -m gpucast_training mlp|timm|simulated|evaluate|all    (from training/)

Importing the package (and `features`, `service`, `label_audit`) needs the standard library only;
the features themselves come from the built gpucast (`service`).
"""
