#pragma once
// a folder nobody placed
