"""Training on the device: ``compile_train_step`` (``step``), what it trains (``spec``), its graph
(``trace``), a loss dynamo cannot capture whole (``segments``), graphs by role (``roles``,
``role_program``), torch.optim updates as traceable functions (``optimizers``), the ordinary loop's
``keep_on_device`` and its update bound once and replayed (``bound_update``), ``data_parallel``, logging calls that
would break a graph (``dynamo_capture``).
"""
