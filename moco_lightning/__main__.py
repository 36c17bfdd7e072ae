from moco_lightning.cli import main

main()
