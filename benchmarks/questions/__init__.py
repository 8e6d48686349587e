"""One module per benchmark question (the module's name is the question's). Each has a docstring (its first line
is what `python -m benchmarks list` prints), main(argv) (the question's own options; runnable as
`python -m benchmarks.questions.NAME`, which writes no result folder) and dry_run(work) (the options of a CPU-sized
run, inputs made in `work`). Optional: OUT_FILE (a file of rows the runner asks for in the result folder through
the question's --out) and headline(rows) (the few figures result.json leads with)."""
