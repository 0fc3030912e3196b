"""Values that live on the device: device copies of parameters (``params``), ``ResidentTensor``
(``resident``: data left on the device), ``DeviceParameter`` and ``DeviceTensor`` (``device_tensor``), whose
downloads of tensors read one after another go in a few waits (``read_ahead``), and what a device partition of a
training forward saves for the backward, as one object (``saved_pack``: ``SavedPack``).
"""
