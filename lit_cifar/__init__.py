"""CIFAR-100 data, nets and the LightningModule of lit-cifar (see README.md, docs/data.md and train.py).

Modules: ``lit_cifar.data`` (CIFAR100DataModule), ``lit_cifar.synthetic`` (offline stand-in),
``lit_cifar.transforms`` (batched augmentation), ``lit_cifar.nets``, ``lit_cifar.module``
(LitClassifier), ``lit_cifar.errors`` (OptionError); ``lit_cifar.cli``: what train.py adds around
LightningCLI. Nothing is imported here, so ``python -m lit_cifar.synthetic`` stays clean.
"""
