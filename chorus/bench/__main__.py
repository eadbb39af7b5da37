from chorus.bench import cmd_bench, parse_args

cmd_bench(parse_args())
