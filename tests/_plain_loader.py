"""The example's data module with a user's plain ``DataLoader`` (no ``state_dict``): for the test of the line that
says a mid-epoch resume from it does not continue bit for bit."""

from __future__ import annotations

from torch.utils.data import DataLoader

from lightning_static_dist.examples.charlm import ByteWindows, CharDataModule


class PlainLoaderData(CharDataModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(ByteWindows(self.train_data, self.block_size), batch_size=self.batch_size, shuffle=True,
                          drop_last=True)
