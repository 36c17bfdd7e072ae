#!/usr/bin/env bash
# Debian's dataset-fashion-mnist (the offline default data, MIT licence), unless it is installed. The package lists
# are fetched first: on a machine that never fetched them (a new container) apt-get install finds no such package.
set -euo pipefail
data="${MOCO_FASHION_MNIST_FILE:-/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz}"
[ -f "$data" ] && exit 0
sudo=${SUDO:-$(command -v sudo >/dev/null && [ "$(id -u)" != 0 ] && echo sudo || true)}
echo "Installing Debian's dataset-fashion-mnist (offline default data)..."
$sudo apt-get update -qq
$sudo apt-get install -y -qq dataset-fashion-mnist
