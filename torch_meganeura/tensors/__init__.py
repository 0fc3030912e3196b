"""Values that live on the device: device copies of parameters (``params``), ``ResidentTensor``
(``resident``: data left on the device), ``DeviceParameter`` and ``DeviceTensor`` (``device_tensor``).
"""
