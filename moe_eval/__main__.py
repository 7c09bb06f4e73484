from moe_eval.cli import main

main()
