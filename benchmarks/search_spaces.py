"""The named search spaces of :mod:`benchmarks.search`: setting -> (its CLI override, the candidates)."""

from __future__ import annotations

D, M = "--data.init_args.", "--model."

#: named search spaces: setting -> (CLI override, the candidates); a Fashion-MNIST space and a tiny one for tests
SPACES: dict[str, dict[str, tuple[str, list]]] = {
    "fashion_mnist": {
        "stem": (M + "stem", ["imagenet", "cifar_stride2", "cifar"]),
        "width": (M + "width", [0.25, 0.5]),
        "min_scale": (D + "min_scale", [0.2, 0.5, 1.0]),
        "translate": (D + "translate", [0, 2, 4]),
        "erase_prob": (D + "erase_prob", [0.0, 0.25, 0.5]),
        "jitter_strength": (D + "jitter_strength", [0.2, 0.4, 0.8]),
        "symmetric": (M + "symmetric", [False, True]),
        "local_views": (D + "local_views", [0, 2]),
        "temperature": (M + "temperature", [0.1, 0.2, 0.3]),
        "queue_size": (M + "queue_size", [1024, 4096, 16384]),
        "lr": (M + "lr", [0.03, 0.06, 0.12]),
        "batch_size": (D + "batch_size", [64, 128, 256]),
        "momentum_schedule": (M + "momentum_schedule", ["constant", "cosine"]),
    },
    "demo": {  # the quickstart's budget (a few minutes on 2 cores): use with --budget-qe, stems cost unequal time
        "stem": (M + "stem", ["imagenet", "cifar_stride2"]),
        "min_scale": (D + "min_scale", [0.3, 0.6, 1.0]),
        "translate": (D + "translate", [0, 2, 4]),
        "erase_prob": (D + "erase_prob", [0.0, 0.25, 0.5]),
        "jitter_strength": (D + "jitter_strength", [0.4, 0.8]),
        "symmetric": (M + "symmetric", [False, True]),
        "temperature": (M + "temperature", [0.1, 0.2, 0.3]),
        "queue_size": (M + "queue_size", [1024, 4096, 16384]),
        "lr": (M + "lr", [0.06, 0.12, 0.24]),
        "batch_size": (D + "batch_size", [64, 128, 256]),
        "momentum_schedule": (M + "momentum_schedule", ["constant", "cosine"]),
    },
    "long": {  # the long config's budget: the settings whose best value depends on the budget (the views, the loss)
        "min_scale": (D + "min_scale", [0.6, 1.0]),
        "translate": (D + "translate", [0, 2]),
        "erase_prob": (D + "erase_prob", [0.25, 0.5]),
        "local_views": (D + "local_views", [0, 2]),
        "local_scale": (D + "local_scale", ["[0.2,0.5]"]),
        "local_size": (D + "local_size", [16]),
        "symmetric": (M + "symmetric", [False, True]),
        "temperature": (M + "temperature", [0.1, 0.2]),
        "queue_size": (M + "queue_size", [1024, 4096]),
    },
    "long_views": {  # issue #44 at the long budget: harder views (crops, translation, erasing, multi-crop), loss, T, K
        "min_scale": (D + "min_scale", [0.2, 0.4, 0.6, 0.8, 1.0]),
        "translate": (D + "translate", [0, 2, 4]),
        "erase_prob": (D + "erase_prob", [0.0, 0.25, 0.5, 0.75]),
        "local_views": (D + "local_views", [0, 2, 4]),
        "local_scale": (D + "local_scale", ["[0.2,0.5]"]),
        "local_size": (D + "local_size", [16]),
        "symmetric": (M + "symmetric", [False, True]),
        "temperature": (M + "temperature", [0.1, 0.2, 0.3]),
        "queue_size": (M + "queue_size", [1024, 4096, 16384]),
    },
    "tiny": {
        "temperature": (M + "temperature", [0.1, 0.2, 0.5]),
        "erase_prob": (D + "erase_prob", [0.0, 0.5]),
    },
}
