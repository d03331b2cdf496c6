"""Stage 6, training: a run's start, begun or resumed, with its checks (`start`, what
`mtrain train`, `mtrain.train` and `mtrain.lab` call), the builder that reads the config and
assembles a run (`build`), the loop that runs it (`trainer`) and the parts in between. What
a run trains on (`data`); one update (`update_step`) with its loss and optimiser (`optim`)
and its compiled fast path (`compiled`); when to validate, save and stop
(`coordinator`); dev loss, BLEU and patience (`validation`); example translations (`examples`);
checkpoints and the state they hold (`state`); the moving average (`moving_average`); the recipe
chosen from the planned budget (`budget_recipe`); the logs (`run_log`, `tensorboard_log`).

It imports only from the stages before it (`core`, `data`, `model`, `run`, `decoding`,
`figures`).
"""
